"""What the router API tests (test_router_api.py, test_router_errors.py) send and expect of the
shared live router of tests/router_server.py: the served model's name and context length, a chat."""

MODEL = "tiny-qwen36"
MAX_MODEL_LEN = 128
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
