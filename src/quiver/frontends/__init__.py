"""Transports: KServe v2 over HTTP (and, with later issues, gRPC and SageMaker routes)."""
