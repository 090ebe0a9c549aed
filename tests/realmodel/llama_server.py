"""Run llama.cpp's HTTP server (embedded in the `xllamacpp` wheel) on loopback until killed.

python -m tests.realmodel.llama_server --model M.gguf --port 18090 [--ctx 512] [--parallel 1]
"""

from __future__ import annotations

import argparse
import time

import xllamacpp


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="path of a GGUF model")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ctx", type=int, default=512, help="context size (n_ctx)")
    parser.add_argument("--parallel", type=int, default=1, help="slots (n_parallel)")
    args = parser.parse_args(argv)

    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.n_ctx = args.ctx
    params.n_parallel = args.parallel
    params.use_jinja = True
    # One thread each: two threads on two shared cores is ~50x slower.
    params.cpuparams.n_threads = 1
    params.cpuparams_batch.n_threads = 1
    params.port = args.port  # listens on 127.0.0.1 only (the default hostnames)
    params.endpoint_props = True  # GET /props reports default_generation_settings.n_ctx
    server = xllamacpp.Server(params)  # serves from its own threads
    try:
        while True:
            time.sleep(3600)
    finally:
        del server


if __name__ == "__main__":
    main()
