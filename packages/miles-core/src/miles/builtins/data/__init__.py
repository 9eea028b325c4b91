"""Built-in data sources: local files (``jsonl``/``parquet``), ``datasets`` (``hf``), ``reasoning_gym``."""
