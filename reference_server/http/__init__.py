"""The HTTP pieces both apps use: error answers, request reading, the admission answers (429 and
RateLimit headers), middleware, the one generation endpoint, and serving with uvicorn."""
