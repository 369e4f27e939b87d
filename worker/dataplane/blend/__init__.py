"""Fragment reuse beyond prefixes: content-key matching anywhere in a prompt, RoPE re-alignment, selective recompute."""
