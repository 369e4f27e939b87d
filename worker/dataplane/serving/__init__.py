"""The HTTP face of Strata's own engine: the node server (server.py, OpenAI-style completions and
the operator endpoints) and the parsing of request fields (fields.py). Above the engine, which
knows nothing of HTTP."""
