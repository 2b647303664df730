"""The generated models and the scripts that write them (`python models/NAME.py`): the zoo's
models with their regression baseline, and llama_large, the large-model generator; installed as
onnxfuse.models."""
