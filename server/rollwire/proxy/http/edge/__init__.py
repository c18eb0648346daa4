"""The door's transport edge, below the routes and above the dialect: connections admitted,
counted and timed before uvicorn parses a byte (connections.py, audit A4), request bodies read
within their limits (bodies.py) and multipart adapter uploads (uploads.py).
"""
