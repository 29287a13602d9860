"""An OpenAI-compatible HTTP server over the batch engine (`python -m fiddler.server --model DIR`); needs the
`server` extra (fastapi, uvicorn), imported only when the server runs."""
