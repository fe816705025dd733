"""--max-sample-bytes: a jsonl line is bounded before it is decoded (megatron_glm5/data/jsonl.py iter_raw_lines),
and read past in bounded chunks, never held whole; lone surrogates are bad lines."""
import io

import pytest

from megatron_glm5.data.jsonl import DataError, iter_jsonl, iter_raw_lines, parse_jsonl_line


class _Recording(io.BytesIO):
    """A binary file that records the largest single read it was asked for."""

    def __init__(self, data: bytes):
        super().__init__(data)
        self.largest = 0

    def readline(self, size=-1):
        assert size is not None and size > 0, "an unbounded readline"
        self.largest = max(self.largest, size)
        return super().readline(size)


def test_long_lines_come_as_their_size_read_in_bounded_chunks():
    data = b"abc\n" + b"x" * 10 + b"\n" + b"y" * 11 + b"\n" + b"z" * (3 << 20) + b"\nlast"
    f = _Recording(data)
    assert list(iter_raw_lines(f, 10)) == [(1, b"abc\n"), (2, b"x" * 10 + b"\n"), (3, 11), (4, 3 << 20), (5, b"last")]
    assert f.largest <= 1 << 20  # the 3 MiB line was never asked for in one read


def test_iter_jsonl_counts_a_long_line_as_too_long(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "a"}\n{"text": "' + "b" * 100 + '"}\n{"text": "c"}\n')
    with pytest.raises(DataError) as ei:
        list(iter_jsonl(p, required={"text": str}, max_sample_bytes=50))
    assert str(ei.value) == (f"{p}:2: line of 112 bytes is longer than --max-sample-bytes 50 (4.77e-05 MiB); split the "
                             "document, or raise the limit") and ei.value.reason == "too_long"
    records = list(iter_jsonl(p, required={"text": str}, max_sample_bytes=50, skip_bad=True))
    assert [n for n, _ in records] == [1, 3]


@pytest.mark.parametrize("line, where", [
    ('{"text": "bad \\ud800 here"}', "'text' holds a lone UTF-16 surrogate '\\ud800' (character 5)"),
    ('{"m": [{"c": "ok"}, {"c": "x\\uDC00"}]}', "'m[1].c' holds a lone UTF-16 surrogate '\\udc00' (character 2)"),
])
def test_lone_surrogate_is_a_bad_line(line, where):
    with pytest.raises(DataError) as ei:
        parse_jsonl_line(line.encode(), "f.jsonl", 3)
    assert str(ei.value).startswith(f"f.jsonl:3: field {where}") and ei.value.reason == "lone_surrogate"
    # a surrogate pair, and an escaped backslash before "ud800", are fine
    assert parse_jsonl_line(b'{"t": "\\ud83d\\ude00", "u": "\\\\ud800"}', "f", 1) == {"t": "\U0001F600",
                                                                                     "u": "\\ud800"}
