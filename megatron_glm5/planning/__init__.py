"""The layout planner: will a GLM-5 layout fit a GPU, and how fast will it go (tools/plan_layout.py, docs/scaling.md).

gpus.py (the GPU table), inventory.py (the parameter tensors of a model chunk, from config.py's counts), layout.py
(group sizes and pipeline chunks from the training flags), buffers.py (megatron-core's gradient / parameter buffers
and optimizer shards), activations.py + memory.py (a rank's peak), comm.py + step_time.py (the step time),
calibration.py (measured layer times), plan.py (all ranks of a layout), report.py (the text), check.py (the
training scripts' start-up check), measure.py (what megatron-core really allocated: the tests' ground truth).
"""
