"""The on-disk checkpoint format (megatron_glm5/checkpoint/format.py): the "glm5" record each writer stores, read
back whichever writer (trainer or converter) stored it, and the directory names and pointer (milliseconds)."""
from __future__ import annotations

import pytest

from megatron_glm5.checkpoint import format as fmt

CONFIG = {"model_type": "glm_moe_dsa", "hidden_size": 64}
TRAIN_LAYOUT = fmt.layout_record(2, 1, 4, 1, 1, 8)
# the records as the trainer and the converter stored them before the format had one module (exact dicts)
TRAINED = {"format_version": 1, "model_config": CONFIG, "mode": "finetune", "trainable": "all",
           "layout": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
                      "expert_model_parallel_size": 4, "expert_tensor_parallel_size": 1, "context_parallel_size": 1,
                      "data_parallel_size": 8}}
CONVERTED = {"format_version": 1, "model_config": CONFIG, "mode": "converted", "mtp": False,
             "layout": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2,
                        "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1,
                        "context_parallel_size": 1, "data_parallel_size": None},
             "source": {"hf_dir": "/hf", "dtype": "auto", "fp8_dequantized": False}}


def test_each_writer_stores_the_keys_it_stored_before():
    trained = fmt.ModelRecord(model_config=CONFIG, layout=TRAIN_LAYOUT, mode="finetune", trainable="all")
    assert trained.to_common() == TRAINED
    converted = fmt.ModelRecord(model_config=CONFIG, mode="converted", mtp=False,
                                layout=fmt.layout_record(1, 2, 1, 1, cp=1, dp=None),
                                source={"hf_dir": "/hf", "dtype": "auto", "fp8_dequantized": False})
    assert converted.to_common() == CONVERTED


@pytest.mark.parametrize("stored", [TRAINED, CONVERTED], ids=["trainer", "converter"])
def test_either_key_set_reads_back(stored):
    record = fmt.ModelRecord.from_common({"iteration": 3, fmt.RECORD_KEY: stored})
    assert record.to_common() == stored
    assert (record.model_config, record.layout, record.mode) == (CONFIG, stored["layout"], stored["mode"])
    assert record.trainable == stored.get("trainable") and record.mtp == stored.get("mtp")


def test_a_checkpoint_without_a_model_description_has_no_record():
    for common in (None, {}, {"glm5": {}}, {"glm5": {"mode": "finetune"}}):
        assert fmt.ModelRecord.from_common(common) is None
    assert fmt.ModelRecord.from_common({"glm5": {"model_config": CONFIG}}).layout is None  # oldest: config only


def test_directories_and_pointer(tmp_path):
    root = str(tmp_path)
    assert fmt.iteration_dir(root, 12) == str(tmp_path / "iter_0000012")
    assert fmt.partial_dir(root, 12) == str(tmp_path / "iter_0000012.partial")
    assert fmt.iteration_of(str(tmp_path / "iter_0000012") + "/") == 12 and fmt.iteration_of(root) is None
    for name in ("iter_0000002", "iter_0000010", "iter_0000004.partial"):
        (tmp_path / name).mkdir()
    assert fmt.complete_dirs(root) == [(10, str(tmp_path / "iter_0000010")), (2, str(tmp_path / "iter_0000002"))]
    assert fmt.partial_dirs(root) == [str(tmp_path / "iter_0000004.partial")]
    assert fmt.read_latest(root) is None
    fmt.write_latest(root, 10)
    assert (tmp_path / fmt.LATEST).read_text() == "10" and fmt.read_latest(root) == 10
    assert fmt.pointed_dir(root, 10) == str(tmp_path / "iter_0000010")
    with pytest.raises(fmt.CheckpointFormatError, match="points to iteration 6, but .*iter_0000006 is missing"):
        fmt.pointed_dir(root, 6)
    (tmp_path / fmt.LATEST).write_text("ten")
    with pytest.raises(fmt.CheckpointFormatError, match="expected an iteration number, found 'ten'"):
        fmt.read_latest(root)


def test_a_pointer_of_garbage_bytes_is_one_error_naming_the_file(tmp_path):
    """A damaged pointer (bytes that are not text, e.g. a flipped high bit) is the format's error, not a
    UnicodeDecodeError."""
    (tmp_path / fmt.LATEST).write_bytes(b"\xb2")
    with pytest.raises(fmt.CheckpointFormatError, match=rf"{fmt.LATEST}: expected an iteration number, found"):
        fmt.read_latest(str(tmp_path))


def test_read_record_needs_a_torch_dist_directory(tmp_path):
    with pytest.raises(fmt.CheckpointFormatError, match=r"no \.metadata \(not a torch_dist checkpoint"):
        fmt.read_record(str(tmp_path))
    (tmp_path / fmt.DCP_METADATA).write_bytes(b"not a pickle")
    with pytest.raises(fmt.CheckpointFormatError, match=r"\.metadata: cannot read the checkpoint metadata"):
        fmt.read_record(str(tmp_path))
