"""Text -> tokens -> global batches: the GPT-2 BPE (`tokenizer`), corpus preparation (`prepare`, the writer),
the prepared files' format (`format`, shared by both sides) and Grain loading (`loader`, the reader)."""
