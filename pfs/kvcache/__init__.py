"""The KV-cache tier: blocks put once, fetched by every node (docs/architecture.md
"KV-cache tier"). ``remote`` is the low-level client of one data server's block store."""
