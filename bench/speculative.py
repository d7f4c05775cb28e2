"""Speculative decoding without a draft model: rankcast with speculation off, `ngram` and
`suffix`, beside llama.cpp's `llama-server` off and with each `--spec-type` that needs no draft
model, on chats whose answers copy text they were given and on chats that do not.

Workloads (32 conversations each, built from the fixed texts in bench/texts/):
- grounded: input-grounded chats on four texts (a README, a Python file, a notice, a short
  history): quote or summarise a passage, rename an identifier in a code file and return the
  whole file, extract fields of a document as JSON (8 instructions per text);
- standard: the standard workload's 32 short open prompts (bench/prompts.json);
- repeat: multi-turn chats whose earlier assistant turn is one of the texts and whose last user
  turn asks for it again (repeat it, restate it, send it again in a quote block, ...).

For each workload and each concurrency (--concurrency, default 1, 8 and 32): at 1, the first
--sequential (default 4) conversations one after another, each alone; at N > 1, N closed-loop
clients (each sends its next conversation as soon as its answer is done) over 64
conversations: the workload's 32, then each again behind a system turn of its own (no prefix
shared with the first round; the same questions, as a server sees questions come back).
Each (workload, concurrency) runs every configuration side by side, each on a fresh engine or
server (so no prefix cache, nor the suffix method's or an ngram-cache's memory of earlier
outputs, holds anything of another configuration or cell) warmed up with one call of unrelated
chats, as many as the clients (up to 8):
- rankcast, the embedded SmolLM2-135M-Instruct in bfloat16, the offline `LLM`'s engine stepped
  here so each output's arrival is timed: speculation off; `ngram` (num_speculative_tokens 5,
  prompt_lookup_min 2, prompt_lookup_max 5); `suffix` (vLLM's defaults);
- llama-server (bench/speculative_llamacpp.py; where bench/llamacpp.py finds the anchor,
  `$LLAMA_CPP_DIR`), on its BF16 GGUF, the same weights in bfloat16: off, and each
  draft-model-free `--spec-type` its `--help` lists (ngram-simple, ngram-map-k, ngram-map-k4v,
  ngram-mod, ngram-cache in the anchor's build) with llama.cpp's defaults, one slot per client,
  through its streaming `/v1/chat/completions` from the same closed-loop clients; its prompts
  (the GGUF's chat template) are checked to be rankcast's token for token. --llama-concurrency
  and --llama-spec-types narrow it; without the anchor the script says it skipped it.
Greedy (temperature 0), --tokens (default 128) at most, EOS honoured (the copy ends where the
model ends it). Every configuration runs --runs times (default 3), alternated, and each one's
fastest run is shown (on a shared 2-core VM anything else running only slows a run down);
every run's texts are checked.

Reported per run: output tokens/s (generated tokens / wall time of the run, prefill included)
and its ratio to the same engine's speculation off; the acceptance length (1 + accepted /
drafts: tokens a request gains per verification it drafted for) and the drafts, drafted and
accepted tokens (rankcast's scheduler's spec_decode counters, llama-server's /metrics ones of
the same names; the warm-up's subtracted); how many greedy texts differ from the same engine's
speculation off (for rankcast that must be none: a difference is an engine bug and is printed
loudly; for llama-server it is reported, as is how many of its texts equal rankcast's off, which
different kernels may legitimately miss by a token); and the per-token latency as time per
output token (TPOT: (last token's arrival - first's) / (tokens - 1)) of each request, p50 and
p99 over the requests (at 1 with 4 requests the p99 is the slowest of 4). rankcast's tokens
arrive as its engine's steps return them, llama-server's as its streamed chunks do. Then
rankcast's methods as ratios to llama-server's fastest `--spec-type` in the cell and to its off,
and issue 64's goal at one client on the grounded workload. rankcast's cost model decides per
step how many drafted tokens to verify (none where a wider step would lower the expected
tokens/s), so a run can draft little or nothing: the drafts column shows it, and "widened" the
share of the steps with drafts to weigh that it did widen (where the drafter counts them).

Written: bench/results/speculative.json (machine: CPU model and ISA; the commit measured; the
llama-server build, file and flags; every configuration's fastest run with its texts) and
speculative.png beside it (tokens/s by concurrency per workload, a bar per rankcast method and
llama-server's off and fastest --spec-type).

    python bench/speculative.py
    python bench/speculative.py --workloads grounded --concurrency 1 8 --tokens 64
    python bench/speculative.py --llama-concurrency 1 --llama-spec-types ngram-mod ngram-simple
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import speculative_llamacpp
from bench.workload import ROOT, Chat, describe, load_chats, machine_info

TEXTS = ROOT / "bench" / "texts"
WORKLOADS = ("grounded", "standard", "repeat")
METHODS: dict[str, dict[str, Any] | None] = {
    "off": None,
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 5,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
    },
    "suffix": {"method": "suffix"},
}
# The warm-up's chats: unrelated to every workload, so the suffix method's memory of outputs
# learns nothing of them from it.
WARM_UP = (
    "Describe a bicycle.",
    "What is a prime number?",
    "Name three colours.",
    "Why do cats purr?",
    "What makes rain fall?",
    "Describe a kitchen.",
    "How do magnets work?",
    "What is a volcano?",
)
WARM_UP_TOKENS = 32

# Per text: how the user hands it over (code fenced) and eight instructions on it.
GROUNDED: dict[str, tuple[str, tuple[str, ...]]] = {
    "tidepool_readme.md": (
        "markdown",
        (
            "Quote, word for word, the sentence that says how tidepool keeps its memory small.",
            "Summarise this README in three sentences.",
            "Rewrite this README with the name tidepool replaced by driftwood everywhere. "
            "Return the whole text.",
            "Quote the installation instructions exactly as they are written.",
            "List every configuration setting this README mentions and what each one does.",
            "Copy the second paragraph exactly.",
            "Turn this README into a bulleted list of facts, keeping its wording.",
            "What happens when the bucket cannot be reached? Answer by quoting the README.",
        ),
    ),
    "inventory.py": (
        "python",
        tuple(
            f"Edit this code file: rename `{old}` to `{new}` everywhere and return the whole "
            "file, nothing else."
            for old, new in (
                ("total_value", "stock_value"),
                ("items", "stock"),
                ("Item", "Product"),
                ("sku", "code"),
                ("restock", "add_stock"),
                ("items_to_reorder", "low_stock"),
                ("quantity", "on_hand"),
                ("unit_price", "price"),
            )
        ),
    ),
    "harbour_notice.txt": (
        "",
        tuple(
            f"Extract this JSON object from the notice, filling in each value: {keys}. "
            "Reply with the JSON only."
            for keys in (
                '{"closed_from": "", "closed_until": "", "contractor": "", "budget_pounds": 0}',
                '{"harbour_master": "", "meeting_date": "", "meeting_time": "", '
                '"meeting_place": ""}',
                '{"email": "", "telephone": ""}',
                '{"shuttle_every_minutes": 0, "shuttle_first": "", "shuttle_last": "", '
                '"detour_metres": 0}',
                '{"handrail_posts": 0, "corroded_posts": 0, "inspection_month": ""}',
                '{"county_fund_pounds": 0, "harbour_dues_pounds": 0}',
                '{"work_hours": "", "work_days": "", "weekend_work": false}',
                '{"bridge": "", "between": ["", ""], "reason": ""}',
            )
        ),
    ),
    "lighthouse.txt": (
        "",
        (
            "Summarise this passage in two sentences.",
            "Quote the sentence about the last keeper exactly.",
            "Copy the first paragraph exactly.",
            'Extract this JSON object from the passage: {"first_lit": 0, "tower_metres": 0, '
            '"automated": 0, "visible_nautical_miles": 0}. Reply with the JSON only.',
            "Rewrite the passage with the word keepers replaced by wardens. Return the whole "
            "passage.",
            "List the years in the passage and what happened in each.",
            "Quote the last paragraph exactly.",
            "What did the keepers do at night? Answer by quoting the passage.",
        ),
    ),
}
# Per text: the user turn the text answered (it becomes the assistant's earlier answer).
OPENERS = {
    "tidepool_readme.md": "Write a short README for tidepool, a log rotation daemon.",
    "inventory.py": "Write a small Python module that tracks a shop's stock levels.",
    "harbour_notice.txt": "Draft a notice about closing the Eastquay Harbour footbridge.",
    "lighthouse.txt": "Tell me the history of the Corran Head lighthouse.",
}
FOLLOW_UPS = (
    "Repeat your previous answer exactly, word for word.",
    "Say that again, please.",
    "Restate your last answer, starting with 'To recap:'.",
    "Copy your previous answer again, without any changes.",
    "Repeat just the first half of your answer.",
    "Write your previous answer again, inside a Markdown quote block.",
    "Repeat your answer, but replace its first paragraph with a one-sentence summary.",
    "I lost your last message. Can you send it again?",
)


def _text(name: str) -> str:
    body = (TEXTS / name).read_text().strip()
    fence = GROUNDED[name][0]
    return f"```{fence}\n{body}\n```" if fence == "python" else body


def grounded_chats() -> list[Chat]:
    """Text-major within each instruction, so the first 4 (or 8) cover every text."""
    names = list(GROUNDED)
    return [
        [{"role": "user", "content": f"{_text(name)}\n\n{GROUNDED[name][1][task]}"}]
        for task in range(8)
        for name in names
    ]


def repeat_chats() -> list[Chat]:
    names = list(GROUNDED)
    return [
        [
            {"role": "user", "content": OPENERS[name]},
            {"role": "assistant", "content": _text(name)},
            {"role": "user", "content": FOLLOW_UPS[turn]},
        ]
        for turn in range(len(FOLLOW_UPS))
        for name in names
    ]


def workload_chats(name: str) -> list[Chat]:
    if name == "grounded":
        return grounded_chats()
    if name == "repeat":
        return repeat_chats()
    return load_chats()[0]


# What a second round of a workload's conversations starts with, so its prompts share no
# prefix with the first round's (the prefix cache would serve them whole otherwise); the
# questions, and so much of each answer, are the same: a server sees questions come back.
SECOND_ROUND_SYSTEM = "You are a helpful assistant. Answer the user's request."


def pool(chats: list[Chat]) -> list[Chat]:
    """What N > 1 clients send: the workload's conversations, then each again behind a system
    turn of its own (64 in all, so 32 clients stay 32 until the pool runs out)."""
    second = [[{"role": "system", "content": SECOND_ROUND_SYSTEM}, *chat] for chat in chats]
    return chats + second


def warm_up_chats(concurrency: int) -> list[Chat]:
    """The warm-up call's chats: as many as the cell's clients, up to all of WARM_UP."""
    width = max(1, min(concurrency, len(WARM_UP)))
    return [[{"role": "user", "content": p}] for p in WARM_UP[:width]]


@functools.cache
def _tokenizer() -> Any:
    from rankcast.model_files.source import resolve_model
    from rankcast.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(None).model_dir)


def rankcast_prompts(chats: list[Chat]) -> list[list[int]]:
    """The prompt token ids rankcast's engine makes of `chats` (the embedded model's chat
    template and tokenizer, applied as `LLMEngine.apply_chat_template` does)."""
    from rankcast.tokenizer import apply_chat_template

    return [apply_chat_template(_tokenizer(), chat) for chat in chats]


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between the nearest ranks; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def generate(
    llm: Any, chats: list[Chat], params: Any, clients: int
) -> tuple[list[Any], list[list[float]], list[float]]:
    """The outputs of `chats` sent by `clients` closed-loop clients (each sends its next
    conversation when its answer is done, so `clients` are always in flight until the pool
    runs out), and for each the arrival time of every output token (tokens that arrive in one
    step share its time) and when it was sent."""
    engine = llm.engine
    order: dict[str, int] = {}
    sent: list[float] = [0.0] * len(chats)

    def send(index: int) -> None:
        prompt = engine.apply_chat_template(chats[index], None)
        order[engine.add_request(prompt, params)] = index
        sent[index] = time.perf_counter()

    waiting = iter(range(len(chats)))
    for _ in range(min(clients, len(chats))):
        send(next(waiting))
    finished: list[Any] = [None] * len(chats)
    arrivals: list[list[float]] = [[] for _ in chats]
    while engine.has_unfinished_requests():
        for output in engine.step():
            index = order.get(output.request_id)
            if index is None:
                continue
            now = time.perf_counter()
            seen = arrivals[index]
            seen.extend([now] * (len(output.outputs[0].token_ids) - len(seen)))
            if output.finished:
                finished[index] = output
                following = next(waiting, None)
                if following is not None:
                    send(following)
    return finished, arrivals, sent


def spec_counters(llm: Any) -> dict[str, Any]:
    """The scheduler's spec_decode counters, and where the drafter keeps them, how many steps
    had drafts to weigh and how many of those the cost model widened (None where it does not)."""
    scheduler = llm.engine.client.core.scheduler
    stats = scheduler.stats()
    drafter = getattr(scheduler, "drafter", None)
    return {
        "drafts": stats.spec_decode_num_drafts,
        "draft_tokens": stats.spec_decode_num_draft_tokens,
        "accepted_tokens": stats.spec_decode_num_accepted_tokens,
        "accepted_per_position": list(stats.spec_decode_num_accepted_tokens_per_pos),
        "steps_with_proposals": getattr(drafter, "steps_with_proposals", None),
        "steps_drafted": getattr(drafter, "steps_drafted", None),
    }


def revision() -> dict[str, Any]:
    """The commit measured and whether rankcast/ differed from it (the figures are that tree's)."""

    def git(*command: str) -> str:
        done = subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    return {
        "commit": git("rev-parse", "HEAD"),
        "rankcast_changes": git("status", "--short", "rankcast"),
    }


def run_cell(
    method: str, chats: list[Chat], concurrency: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One fresh engine: a warm-up call, then the chats (one after another at concurrency 1,
    all at once otherwise), timed."""
    from rankcast import LLM, SamplingParams

    started = time.perf_counter()
    config = METHODS[method]
    kwargs: dict[str, Any] = {"kv_cache_space_gib": args.kv_cache_space, "max_num_seqs": 32}
    if config is not None:
        kwargs["speculative_config"] = dict(config)
    llm = LLM(**kwargs)
    try:
        warm = warm_up_chats(concurrency)
        llm.chat(warm, SamplingParams(temperature=0, max_tokens=WARM_UP_TOKENS))
        before = spec_counters(llm) if config is not None else None
        params = SamplingParams(temperature=0, max_tokens=args.tokens)
        begin = time.perf_counter()
        outputs, arrivals, starts = generate(llm, chats, params, concurrency)
        seconds = time.perf_counter() - begin
        after = spec_counters(llm) if config is not None else None
    finally:
        llm.shutdown()
    tokens = [len(o.outputs[0].token_ids) for o in outputs]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in arrivals if len(t) > 1]
    ttft = [t[0] - start for t, start in zip(arrivals, starts, strict=True) if t]
    row: dict[str, Any] = {
        "method": method,
        "speculative_config": config,
        "requests": len(outputs),
        "output_tokens": sum(tokens),
        "seconds": seconds,
        "tokens_per_s": sum(tokens) / seconds,
        "tpot_ms": [seconds * 1000 for seconds in tpot],
        "ttft_ms": [seconds * 1000 for seconds in ttft],
        "request_tokens": tokens,
        "texts": [o.outputs[0].text for o in outputs],
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "engine_seconds": time.perf_counter() - started,
    }
    if before is not None and after is not None:
        spec = {
            key: after[key] - before[key] for key in ("drafts", "draft_tokens", "accepted_tokens")
        }
        key = "accepted_per_position"
        positions = zip(after[key], before[key], strict=True)
        spec["accepted_per_position"] = [a - b for a, b in positions]
        if after["steps_drafted"] is not None and before["steps_drafted"] is not None:
            for key in ("steps_with_proposals", "steps_drafted"):
                spec[key] = after[key] - before[key]
            spec["widened_share"] = (
                spec["steps_drafted"] / spec["steps_with_proposals"]
                if spec["steps_with_proposals"]
                else None
            )
        spec["acceptance_length"] = (
            1 + spec["accepted_tokens"] / spec["drafts"] if spec["drafts"] else None
        )
        spec["draft_acceptance_rate"] = (
            spec["accepted_tokens"] / spec["draft_tokens"] if spec["draft_tokens"] else None
        )
        row["spec_decode"] = spec
    return with_latency(row)


def with_latency(row: dict[str, Any]) -> dict[str, Any]:
    """`row` with its requests' TPOT p50 and p99 and TTFT p50 (ms; None without requests)."""
    row["tpot_ms_p50"] = percentile(row["tpot_ms"], 50)
    row["tpot_ms_p99"] = percentile(row["tpot_ms"], 99)
    row["ttft_ms_p50"] = percentile(row["ttft_ms"], 50)
    return row


def compare(tries: dict[str, list[dict[str, Any]]], key: str) -> list[dict[str, Any]]:
    """Per method, its fastest run, with every run's tok/s; every run's answers (`key`: token
    ids, or texts where the engine gives no ids) are checked against the first method's
    (speculation off's) first run: greedy, they must be identical, off's other runs included;
    a conversation is counted once however many runs differ."""
    reference = next(iter(tries.values()))[0][key]
    rows = []
    for runs in tries.values():
        differing = sorted(
            {
                index
                for run in runs
                for index, (ours, theirs) in enumerate(zip(run[key], reference, strict=True))
                if ours != theirs
            }
        )
        fastest: dict[str, Any] = max(runs, key=lambda run: run["tokens_per_s"])
        row = dict(fastest)
        row["runs_tokens_per_s"] = [run["tokens_per_s"] for run in runs]
        row["differing_texts"] = len(differing)
        row["differing_indices"] = differing
        rows.append(row)
    off = rows[0]["tokens_per_s"]
    for row in rows:
        row["ratio_to_off"] = row["tokens_per_s"] / off
    return rows


def with_llama(
    cell: dict[str, Any],
    rankcast_tries: dict[str, list[dict[str, Any]]],
    llama_tries: dict[str, list[dict[str, Any]]],
) -> None:
    """Adds llama-server's rows to `cell` (each configuration's fastest run; its texts checked
    against its own speculation off, and counted where every run equals rankcast's off), its
    fastest --spec-type, and rankcast's rows' ratios to that and to llama-server's off. Nothing
    is added without a complete llama-server off to compare with."""
    llama_tries = {name: runs for name, runs in llama_tries.items() if runs}
    if speculative_llamacpp.OFF not in llama_tries:
        return
    rows = compare(llama_tries, "texts")
    reference = rankcast_tries["off"][0]["texts"]
    for row, runs in zip(rows, llama_tries.values(), strict=True):
        row["equal_to_rankcast"] = sum(
            all(run["texts"][index] == text for run in runs) for index, text in enumerate(reference)
        )
    cell["llama_rows"] = rows
    off = rows[0]
    best = max(rows[1:], key=lambda row: row["tokens_per_s"], default=None)
    cell["llama_best"] = None if best is None else best["method"]
    for row in cell["rows"]:
        row["ratio_to_llama_off"] = row["tokens_per_s"] / off["tokens_per_s"]
        row["ratio_to_llama_best"] = (
            None if best is None else row["tokens_per_s"] / best["tokens_per_s"]
        )


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _llama_best(cell: dict[str, Any]) -> dict[str, Any] | None:
    name = cell.get("llama_best")
    return next((row for row in cell.get("llama_rows", ()) if row["method"] == name), None)


def print_table(cells: list[dict[str, Any]], machine: dict[str, Any], llama: bool) -> None:
    """Every method's fastest run per cell (llama-server's rows after rankcast's: "x off" and
    "differ" against its own speculation off, "= rankcast" its texts equal to rankcast's off),
    then rankcast as ratios to llama-server and the goals of issue 64."""
    print(f"\nSmolLM2-135M-Instruct, bfloat16, greedy; {describe(machine)}")
    if llama:
        print(
            f"rankcast (embedded model) and llama-server ({speculative_llamacpp.WEIGHT_TYPE} "
            "GGUF: the same weights in bfloat16; llama.cpp's defaults per --spec-type)"
        )
    header = (
        f"{'workload':<9}{'conc':>5} {'method':<20}{'tok/s':>8}{'x off':>7}{'acc len':>8}"
        f"{'drafts':>8}{'drafted':>8}{'accepted':>9}{'widened':>8}"
        f"{'TPOT p50':>9}{'p99 ms':>8}{'differ':>7}" + (f"{'= rankcast':>11}" if llama else "")
    )
    print(header)
    print("-" * len(header))
    for cell in cells:
        for row in [*cell["rows"], *cell.get("llama_rows", ())]:
            spec = row.get("spec_decode") or {}
            same = row.get("equal_to_rankcast")
            print(
                f"{cell['workload']:<9}{cell['concurrency']:>5} {row['method']:<20}"
                f"{row['tokens_per_s']:>8.1f}{row['ratio_to_off']:>6.2f}x"
                f"{_fmt(spec.get('acceptance_length'), '.2f'):>8}"
                f"{spec.get('drafts', '-'):>8}{spec.get('draft_tokens', '-'):>8}"
                f"{spec.get('accepted_tokens', '-'):>9}"
                f"{_percent(spec.get('widened_share')):>8}"
                f"{_fmt(row['tpot_ms_p50'], '.1f'):>9}{_fmt(row['tpot_ms_p99'], '.1f'):>8}"
                f"{row['differing_texts']:>4}/{row['requests']:<2}"
                + (
                    (f"{same:>8}/{row['requests']:<2}" if same is not None else f"{'-':>11}")
                    if llama
                    else ""
                )
            )
    differ = [
        (cell["workload"], cell["concurrency"], row["method"], row["differing_texts"])
        for cell in cells
        for row in cell["rows"]
        if row["differing_texts"]
    ]
    if differ:
        print("\n" + "!" * 78)
        print("GREEDY TEXTS DIFFER FROM SPECULATION OFF (an engine bug: speculation must not")
        print("change a greedy answer):")
        for workload, concurrency, method, count in differ:
            print(f"  {workload} at concurrency {concurrency}, {method}: {count} text(s)")
        print("!" * 78)
    else:
        print("\nevery rankcast greedy text with speculation is identical to speculation off's")
    if llama:
        print_llama_checks(cells)
        print_versus(cells)
    print_goals(cells)


def print_llama_checks(cells: list[dict[str, Any]]) -> None:
    """llama-server's failures, its exactness (its texts against its own off) and its prompts
    against rankcast's."""
    for cell in cells:
        for name, error in cell.get("llama_errors", {}).items():
            print(f"{cell['workload']} at {cell['concurrency']}: {name} FAILED, left out: {error}")
        if cell.get("llama_errors") is not None and "llama_rows" not in cell:
            print(f"{cell['workload']} at {cell['concurrency']}: no llama-server off, no rows")
    differ = [
        f"{cell['workload']} at {cell['concurrency']}, {row['method']}: "
        f"{row['differing_texts']} of {row['requests']}"
        for cell in cells
        for row in cell.get("llama_rows", ())
        if row["differing_texts"]
    ]
    if differ:
        print(
            "llama-server's greedy texts differing from its own speculation off's first run "
            "(off: between its own runs):"
        )
        for line in differ:
            print(f"  {line}")
    elif any(cell.get("llama_rows") for cell in cells):
        print("every llama-server greedy text is identical to its own speculation off's")
    prompts = [
        f"{cell['workload']} at {cell['concurrency']}, {row['method']}: "
        f"{row['prompt_tokens_differing']} prompt(s) of another length"
        + ("" if row["first_prompt_tokens_equal"] else ", the first one's tokens differ")
        for cell in cells
        for row in cell.get("llama_rows", ())
        if row["prompt_tokens_differing"] or not row["first_prompt_tokens_equal"]
    ]
    if prompts:
        print("llama-server's prompts DIFFER from rankcast's (its GGUF's chat template):")
        for line in prompts:
            print(f"  {line}")
    elif any(cell.get("llama_rows") for cell in cells):
        print(
            "llama-server's prompts are rankcast's: every request's token count, and the "
            "first conversation's tokens one by one"
        )


def print_versus(cells: list[dict[str, Any]]) -> None:
    """rankcast's methods as ratios to llama-server's fastest --spec-type and to its off."""
    print(
        "\nrankcast / llama-server, fastest runs: x best = to llama-server's fastest "
        "--spec-type, x off = to llama-server without speculation"
    )
    header = (
        f"{'workload':<9}{'conc':>5}  {'llama best':<20}{'tok/s':>8}{'off tok/s':>10}"
        + "".join(f"{method + ' x best':>15}{'x off':>7}" for method in METHODS)
    )
    print(header)
    print("-" * len(header))
    for cell in cells:
        if "llama_rows" not in cell:
            continue
        best = _llama_best(cell)
        off = cell["llama_rows"][0]
        line = (
            f"{cell['workload']:<9}{cell['concurrency']:>5}  "
            f"{(best['method'].removeprefix('llama ') if best else '-'):<20}"
            f"{_fmt(best['tokens_per_s'] if best else None, '.1f'):>8}"
            f"{off['tokens_per_s']:>10.1f}"
        )
        for row in cell["rows"]:
            line += (
                f"{_ratio(row['ratio_to_llama_best']):>15}{_ratio(row['ratio_to_llama_off']):>7}"
            )
        print(line)


def print_goals(cells: list[dict[str, Any]]) -> None:
    """Issue 64's single-client goal on the grounded workload, where that cell ran."""
    cell = next((c for c in cells if c["workload"] == "grounded" and c["concurrency"] == 1), None)
    if cell is None:
        return
    fastest = max(
        (row for row in cell["rows"] if row["method"] != "off"),
        key=lambda row: row["tokens_per_s"],
    )
    best = _llama_best(cell)
    versus = (
        f", {_ratio(fastest['ratio_to_llama_best'])} llama-server's fastest "
        f"{best['method'].removeprefix('llama ')} (goal >= 1.5x)"
        if best is not None
        else ", llama-server not compared"
    )
    print(
        f"\ngoal, grounded at 1 client: rankcast {fastest['method']} "
        f"{_ratio(fastest['ratio_to_off'])} its speculation off (goal >= 2x){versus}; "
        f"greedy texts differing from off: {fastest['differing_texts']}"
    )


def plot(cells: list[dict[str, Any]], workloads: list[str], path: Path, title: str) -> Path | None:
    """Per workload, tok/s by concurrency: a bar per rankcast method and, where llama-server
    ran, its off and its fastest --spec-type (named), each with its ratio to its off above it."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install '.[bench]'): no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def pick(cell: dict[str, Any], method: str) -> dict[str, Any] | None:
        if method == "llama best":
            return _llama_best(cell)
        rows = [*cell["rows"], *cell.get("llama_rows", ())]
        return next((r for r in rows if r["method"] == method), None)

    methods = list(METHODS)
    if any(cell.get("llama_rows") for cell in cells):
        methods += [speculative_llamacpp.OFF, "llama best"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.6 * len(workloads), 4.4), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    width = 0.8 / len(methods)
    for ax, workload in zip(axes[0], workloads, strict=True):
        mine = [c for c in cells if c["workload"] == workload]
        levels = [c["concurrency"] for c in mine]
        for m, method in enumerate(methods):
            rows = [pick(c, method) for c in mine]
            values = [0.0 if row is None else row["tokens_per_s"] for row in rows]
            xs = [i + (m - (len(methods) - 1) / 2) * width for i in range(len(levels))]
            bars = ax.bar(xs, values, width, label=method, color=colours[m % len(colours)])
            for bar, row in zip(bars, rows, strict=True):
                if row is None or method in ("off", speculative_llamacpp.OFF):
                    continue
                label = f"{row['ratio_to_off']:.2f}x"
                if method == "llama best":
                    label = f"{row['method'].removeprefix('llama ')} {label}"
                ax.annotate(
                    label,
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=5 if method == "llama best" else 6,
                    rotation=90 if method == "llama best" else 0,
                )
        ax.set_xticks(range(len(levels)), [str(n) for n in levels])
        ax.set_xlabel("concurrent conversations")
        ax.set_ylabel("output tok/s")
        ax.set_title(workload)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=6)
    # About 15 characters of 8-point text to an inch: wrapped, a narrow figure shows it all.
    wrapped = [textwrap.fill(line, int(fig.get_figwidth() * 15)) for line in title.splitlines()]
    fig.suptitle("\n".join(wrapped), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def llama_plan(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[list[str], list[int], dict[str, Any]]:
    """The --spec-type values and concurrency levels llama-server runs at (none where it is
    absent or not asked for), and what the output says of it."""
    levels = args.concurrency if args.llama_concurrency is None else args.llama_concurrency
    if any(n not in args.concurrency for n in levels):
        parser.error("--llama-concurrency levels must be among --concurrency's")
    problem = speculative_llamacpp.missing_message()
    if problem is not None:
        return [], [], {"note": f"llama-server --spec-type: skipped ({problem})"}
    if not levels:
        return [], [], {"note": "llama-server --spec-type: not run (--llama-concurrency empty)"}
    offered = speculative_llamacpp.draft_free_types()
    types = list(offered) if args.llama_spec_types is None else args.llama_spec_types
    unknown = [t for t in types if t not in offered]
    if unknown:
        parser.error(
            f"--llama-spec-types {' '.join(unknown)}: not a draft-model-free --spec-type of "
            f"this llama-server ({', '.join(offered) or 'it lists none'})"
        )
    info = speculative_llamacpp.server_info()
    note = (
        f"llama-server ({info['version']}) on {info['model']}: off and --spec-type "
        f"{', '.join(types) or '(none)'} (llama.cpp's defaults) at concurrency "
        f"{', '.join(map(str, levels))}"
    )
    return types, list(levels), {"note": note, "spec_types": types, "concurrency": levels, **info}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--sequential", type=int, default=4, help="conversations run one by one at concurrency 1"
    )
    parser.add_argument("--tokens", type=int, default=128, help="max tokens per answer")
    parser.add_argument(
        "--runs", type=int, default=3, help="runs per method, alternated; the fastest is shown"
    )
    parser.add_argument("--kv-cache-space", type=float, default=0.5, help="GiB per engine")
    parser.add_argument(
        "--llama-concurrency",
        type=int,
        nargs="*",
        help="the --concurrency levels llama-server also runs at (default: all; the flag alone: "
        "none, llama-server is not run)",
    )
    parser.add_argument(
        "--llama-spec-types",
        nargs="+",
        help="llama-server --spec-type values to run besides its off (default: every one the "
        "installed llama-server lists that needs no draft model)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "speculative.json")
    args = parser.parse_args()
    if any(n < 1 or n > 32 for n in args.concurrency):
        parser.error("--concurrency levels must be 1..32 (32 conversations per workload)")

    started = time.perf_counter()
    machine = machine_info()
    tree = revision()
    print(
        f"rankcast at {tree['commit'][:12]}"
        + (" (rankcast/ changed)" if tree["rankcast_changes"] else "")
    )
    load = {"start": os.getloadavg()}
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in load['start'])}")
    llama_types, llama_levels, llama_info = llama_plan(args, parser)
    print(llama_info["note"], flush=True)
    cells: list[dict[str, Any]] = []
    for workload in args.workloads:
        chats = workload_chats(workload)
        for concurrency in args.concurrency:
            chosen = chats[: args.sequential] if concurrency == 1 else pool(chats)
            configs: list[str | None] = [None, *llama_types] if concurrency in llama_levels else []
            prompts = rankcast_prompts(chosen) if configs else []
            warm = (warm_up_chats(concurrency), WARM_UP_TOKENS)
            tries: dict[str, list[dict[str, Any]]] = {method: [] for method in METHODS}
            llama_tries: dict[str, list[dict[str, Any]]] = {
                speculative_llamacpp.method_name(t): [] for t in configs
            }
            llama_errors: dict[str, str] = {}
            for attempt in range(args.runs):
                for method in METHODS:
                    print(
                        f"{workload}, concurrency {concurrency}, {method}, run {attempt + 1} ...",
                        flush=True,
                    )
                    row = run_cell(method, chosen, concurrency, args)
                    tries[method].append(row)
                    _print_run(row)
                for spec_type in configs:
                    name = speculative_llamacpp.method_name(spec_type)
                    if name in llama_errors:
                        continue
                    print(
                        f"{workload}, concurrency {concurrency}, {name}, run {attempt + 1} ...",
                        flush=True,
                    )
                    try:
                        row = speculative_llamacpp.run_config(
                            spec_type, chosen, concurrency, args.tokens, warm, prompts
                        )
                    except (OSError, RuntimeError, TimeoutError) as error:
                        llama_errors[name] = str(error)
                        print(f"  {name} failed, left out of this cell: {error}")
                        print(speculative_llamacpp.log_tail(), flush=True)
                        llama_tries[name] = []
                        continue
                    llama_tries[name].append(with_latency(row))
                    _print_run(row)
            cell: dict[str, Any] = {
                "workload": workload,
                "concurrency": concurrency,
                "rows": compare(tries, "token_ids"),
            }
            if configs:
                with_llama(cell, tries, llama_tries)
                cell["llama_errors"] = llama_errors
            cells.append(cell)
    load["end"] = os.getloadavg()
    print_table(cells, machine, llama=bool(llama_levels))
    print(llama_info["note"])
    shown = {when: " ".join(f"{x:.2f}" for x in figures) for when, figures in load.items()}
    print(f"load average (1, 5, 15 min) at start {shown['start']}, at end {shown['end']}")
    seconds = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": machine,
                "workload": {
                    "workloads": args.workloads,
                    "concurrency": args.concurrency,
                    "sequential": args.sequential,
                    "runs": args.runs,
                    "max_tokens": args.tokens,
                    "greedy": True,
                    "ignore_eos": False,
                    "methods": METHODS,
                    "kv_cache_space_gib": args.kv_cache_space,
                    "latency": (
                        "per request: TPOT = (last token's arrival - first's) / (tokens - 1), "
                        "arrivals timed as the offline engine's steps return (rankcast) or as "
                        "the streamed chunks with text arrive (llama-server); p50/p99 over "
                        "the run's requests"
                    ),
                },
                "revision": tree,
                "llama_server": llama_info,
                "seconds": seconds,
                "load_average": load,
                "cells": cells,
            },
            indent=2,
        )
    )
    engines = "rankcast" + (
        f" and llama-server ({speculative_llamacpp.WEIGHT_TYPE} GGUF)" if llama_levels else ""
    )
    title = (
        f"speculative decoding, {engines}, SmolLM2-135M-Instruct bfloat16, greedy, <= "
        f"{args.tokens} tokens; ratios to off above the bars\n{describe(machine)}"
    )
    png = plot(cells, args.workloads, args.out.with_suffix(".png"), title)
    print(f"\nwrote {args.out}" + (f" and {png}" if png else ""))
    print(f"({seconds / 60:.1f} min)")


def _print_run(row: dict[str, Any]) -> None:
    print(
        f"  {row['output_tokens']} tokens in {row['seconds']:.1f} s: "
        f"{row['tokens_per_s']:.1f} tok/s",
        flush=True,
    )


if __name__ == "__main__":
    main()
