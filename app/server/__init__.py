"""`gapless serve`: an OpenAI-compatible HTTP server in front of one engine.

protocol.py   request bodies -> what the engine runs, results -> OpenAI JSON, errors as OpenAI error objects
engine_queue  one engine thread; requests wait first come first served in a bounded queue
http.py       the Starlette app: routes, API key, body limit, SSE streaming, disconnect -> cancel
"""
