"""Tokenize a local corpus into shards for `data=tokenized`: `python prepare.py input=... output=DIR tokenizer=bpe`.

Text, JSONL or Parquet files; a byte-level BPE trained on the corpus (`tokenizer=bpe tokenizer.vocab_size=N`) or a
local tokenizer (`tokenizer=local tokenizer.path=...`). The work is done by
`lightning_trainopt.data.prepare.prepare_corpus`, which tests call directly.
"""

from lightning_trainopt.launch.prepare_cli import prepare_main

if __name__ == "__main__":
    prepare_main()
