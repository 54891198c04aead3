"""The engine's core: requests in, one step = schedule -> run (through an executor) -> update from its output ->
sample -> process outputs, outputs out. Scheduler, block manager, sequences, detokenizer, beam search, sampling
defaults and grammar state live here; nothing in core touches a model or a KV-cache tensor."""
