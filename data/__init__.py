"""Text -> tokens -> global batches: tiktoken GPT-2 BPE, `datasets` preparation, Grain loading."""
