"""Worker service: the model, the paged KV-cache tensor, executing steps and
moving blocks to and from the KV cache service."""
