"""The reference server: an OpenAI-compatible server that keeps the KV admission contract."""
