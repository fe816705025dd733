"""The bound on one input line, shared by the flags (arguments.py, tools/preprocess_data.py) and the jsonl readers
(data/jsonl.py, data/preprocess.py).  Standard library only: arguments.py stays cheap to import."""

# --max-sample-bytes: a jsonl line longer than this is refused before it is decoded (JSON decoding and tokenizing
# one line costs far more memory than its bytes: a 50 MB line took 14 GB).  8 MiB holds a book-length document.
MAX_SAMPLE_BYTES = 8 * 1024 * 1024
