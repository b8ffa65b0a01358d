"""``inferlb bench worker``: the worker alone: raw ONNX Runtime against the HTTP worker, batching,
fp32 against int8."""
