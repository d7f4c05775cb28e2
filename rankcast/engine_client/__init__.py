"""What runs inside every API server and the offline `LLM`: the clients of the engine cores,
output processing (detokenizing, stop strings), and the choice of engine per request.

Nothing here imports `rankcast.engine_core`; the two sides meet only through
`rankcast.protocol`, and the offline engine gets its in-process core from its caller
(tests/test_import_layers.py holds this).
"""
