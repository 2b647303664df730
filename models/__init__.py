"""The model zoo: the generated models, the scripts that write them (`python models/NAME.py`) and
their regression baseline; installed as onnxfuse.models."""
