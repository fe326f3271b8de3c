"""Wire formats: KServe v2 JSON with Triton's binary tensor extension, BYTES encoding."""
