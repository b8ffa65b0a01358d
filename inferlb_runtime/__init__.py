"""Process plumbing shared by the three services: JSON logging, layered settings,
uvicorn embedded in a service's own loop, backoff and supervised retries.

Services may import this package; it imports none of them, so the services
still never import each other.
"""
