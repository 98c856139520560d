"""The retrieval service behind HTTP: requests, limits, keys, the FastAPI app
(Ray Serve wraps it in qrag.distributed)."""
