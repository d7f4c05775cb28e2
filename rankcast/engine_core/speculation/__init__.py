"""Speculative decoding without a draft model: drafts read from text already present, checked
by the model in the step that decodes (worker/verification.py), decided per step by a measured
cost model (drafter.py)."""
