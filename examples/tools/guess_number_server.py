"""The guess-the-number environment on an OpenEnv server (openenv-core's FastAPI app, one game per WebSocket
session), for `guess_number_remote.yaml`: ``python guess_number_server.py --port 8010`` in this folder."""

from __future__ import annotations

import argparse

import uvicorn
from guess_number_env import GuessAction, GuessNumberEnvironment, GuessObservation
from openenv.core.env_server.http_server import create_fastapi_app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8010)
    parser.add_argument("--sessions", type=int, default=64, help="games at once (the tool workers' episodes)")
    parser.add_argument(
        "--ping-s", type=float, default=20.0, help="seconds between keep-alive pings, and for their answer"
    )
    args = parser.parse_args()
    app = create_fastapi_app(GuessNumberEnvironment, GuessAction, GuessObservation, max_concurrent_envs=args.sessions)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        ws_ping_interval=args.ping_s,
        ws_ping_timeout=args.ping_s,
    )


if __name__ == "__main__":
    main()
