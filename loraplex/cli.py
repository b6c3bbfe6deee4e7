"""`loraplex` command line: serve | db | admin | generate | model."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from loraplex.engine.errors import EngineError


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, EngineError) as error:
        print(f"loraplex: error: {error}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    commands = parser.add_subparsers(required=True, metavar="command")

    generate = commands.add_parser("generate", help="answer one prompt from the command line")
    generate.add_argument("prompt")
    generate.add_argument("--model", help="checkpoint directory, or 'default' (SmolLM2)")
    generate.add_argument("--config", type=Path, help="engine config (TOML)")
    generate.add_argument("--max-tokens", type=int, default=256)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--adapter", help="a PEFT LoRA adapter directory to answer with")
    generate.add_argument(
        "--raw", action="store_true", help="send the prompt as is, without the chat template"
    )
    generate.set_defaults(func=_generate)

    serve = commands.add_parser("serve", help="run the OpenAI-compatible server")
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--config", type=Path, help="settings file (TOML)")
    serve.add_argument(
        "--demo",
        action="store_true",
        help="set up a demo tenant with the demo adapters and print a key for it",
    )
    serve.add_argument(
        "--ray",
        action="store_true",
        help="run on Ray Serve: engine replicas behind one endpoint (pip install loraplex[ray])",
    )
    serve.set_defaults(func=_serve)

    db = commands.add_parser("db", help="manage the registry database")
    db.add_argument("--config", type=Path, help="settings file (TOML)")
    db_commands = db.add_subparsers(required=True, metavar="action")
    upgrade = db_commands.add_parser("upgrade", help="migrate to the newest schema")
    upgrade.add_argument("revision", nargs="?", default="head")
    upgrade.set_defaults(func=_db_upgrade)
    downgrade = db_commands.add_parser("downgrade", help="migrate down to a revision")
    downgrade.add_argument("revision")
    downgrade.set_defaults(func=_db_downgrade)
    current = db_commands.add_parser("current", help="print the schema revision")
    current.set_defaults(func=_db_current)

    from loraplex.admin_cli import add_admin_commands

    add_admin_commands(commands)

    model = commands.add_parser("model", help="manage the base model")
    model_commands = model.add_subparsers(required=True, metavar="action")
    prepare = model_commands.add_parser(
        "prepare", help="fetch and convert the default model (SmolLM2-135M-Instruct)"
    )
    prepare.add_argument("--force", action="store_true", help="convert again even if present")
    prepare.set_defaults(func=_prepare)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from loraplex.platform.server import serve
    from loraplex.platform.settings import load_settings

    overrides = {"host": args.host, "port": args.port}
    settings = load_settings(args.config, **overrides)
    if args.ray:
        if args.demo:
            print("--demo sets up the single-process server only", file=sys.stderr)
            return 2
        from loraplex.platform.ray_serve import run

        return run(settings, args.config, overrides)  # None values: unset (load_settings)
    return serve(settings, demo=args.demo)


def _db_upgrade(args: argparse.Namespace) -> int:
    from loraplex.platform.db import migrate
    from loraplex.platform.settings import load_settings

    url = load_settings(args.config).database
    migrate.upgrade(url, args.revision)
    print(f"database at revision {migrate.current(url)}")
    return 0


def _db_downgrade(args: argparse.Namespace) -> int:
    from loraplex.platform.db import migrate
    from loraplex.platform.settings import load_settings

    url = load_settings(args.config).database
    migrate.downgrade(url, args.revision)
    print(f"database at revision {migrate.current(url)}")
    return 0


def _db_current(args: argparse.Namespace) -> int:
    from loraplex.platform.db import migrate
    from loraplex.platform.settings import load_settings

    url = load_settings(args.config).database
    print(f"{migrate.current(url)} (newest: {migrate.head(url)})")
    return 0


def load_engine_config(path: Path | None, model: str | None = None):
    from loraplex.platform.settings import load_settings

    return load_settings(path, model=model).engine_config()


def _generate(args: argparse.Namespace) -> int:
    from loraplex.engine.engine import LLMEngine, LoRARequest
    from loraplex.engine.sampling_params import SamplingParams

    engine = LLMEngine(load_engine_config(args.config, model=args.model))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    prompt = args.prompt
    if not args.raw and engine.tokenizer.hf.chat_template:
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    lora = LoRARequest(args.adapter, args.adapter) if args.adapter else None
    engine.add_request(engine.make_request(prompt, params, lora=lora))
    while engine.has_unfinished():
        for delta in engine.step():
            sys.stdout.write(delta.outputs[0].text)
            sys.stdout.flush()
            if delta.error is not None:
                raise delta.error
    sys.stdout.write("\n")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from loraplex.engine.default_model import prepare_default_model

    logging.getLogger("loraplex").setLevel(logging.INFO)
    print(prepare_default_model(force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
