"""The `pagedserve` command: generate, chat, serve.

    pagedserve generate "The capital of France is"
    pagedserve chat
    pagedserve serve --port 8000

Every command checks its arguments before the model loads (torch and the
weights take seconds; a typo should not), and `--help` imports nothing heavy.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pagedserve import __version__
from pagedserve.cli_args import add_chat_template_arg, add_sampling_args, add_verbose
from pagedserve.engine_config import add_engine_args

# The exit status of a command stopped by Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130
EXIT_USAGE = 2


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written; wider help columns than argparse's default."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedserve.cli_run import Output, check_args, engine_sampling_params, load_engine, stream_reply

    overrides = check_args(args, args.prompt)
    loaded = load_engine(args, overrides, args.prompt, chat=args.chat_template)
    engine, ids = loaded.engine, loaded.prompt_ids
    params = engine_sampling_params(engine, overrides)
    if args.chat_template:
        if ids is None:
            from pagedserve.engine.tokenizer import apply_chat_template
            ids = apply_chat_template(engine.info().tokenizer, [{"role": "user", "content": args.prompt}])
        prompt, echo = {"prompt_token_ids": ids}, ""
    else:
        prompt = {"prompt": args.prompt, "prompt_token_ids": ids} if ids is not None else args.prompt
        echo = args.prompt
    out = Output()
    args.output = out  # main() ends an unfinished line before it reports an error
    reply = stream_reply(engine, "generate-0", prompt, params, out, echo=echo)
    if reply.interrupted:
        return EXIT_INTERRUPTED
    print(f"[{reply.tokens} tokens in {reply.seconds:.2f} s, {reply.tokens / max(reply.seconds, 1e-9):.1f} tok/s "
          f"on {engine.info().device}]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pagedserve.cli_chat import run_chat
    from pagedserve.cli_run import check_args, load_engine

    from pagedserve.cli_args import read_chat_template

    overrides = check_args(args)
    read_chat_template(args.chat_template)  # a missing file fails before the model loads
    return run_chat(load_engine(args, overrides).engine, args, overrides)


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedserve.server.args import check_server_args

    check_server_args(args)
    from pagedserve.server.app import serve
    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"pagedserve {__version__}")
    add_verbose(parser, top_level=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,chat,serve}")

    def command(name: str, help: str, func) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, formatter_class=_HelpFormatter)
        add_verbose(p, top_level=False)
        p.set_defaults(func=func)
        return p

    gen = command("generate", "complete one prompt, streaming to stdout", cmd_generate)
    gen.add_argument("prompt")
    gen.add_argument("--chat-template", action="store_true", help="wrap the prompt as a user chat message")
    add_sampling_args(gen, max_tokens=64)
    add_engine_args(gen)

    chat = command("chat", "interactive chat in the terminal (Ctrl-C stops a reply, exit or Ctrl-D leaves)",
                   cmd_chat)
    chat.add_argument("--system", default=None, metavar="TEXT", help="system prompt (default: the chat template's)")
    add_chat_template_arg(chat)
    add_sampling_args(chat, max_tokens=256)
    add_engine_args(chat)

    serve = command("serve", "OpenAI-compatible HTTP server", cmd_serve)
    from pagedserve.server.args import add_server_args  # argparse only: keeps --help quick
    add_server_args(serve)
    add_engine_args(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:  # while loading: leave quietly, as a stopped reply does
        _end_line(args)
        return EXIT_INTERRUPTED
    except ValueError as err:  # RequestError included: a bad flag, prompt or model directory
        from pagedserve.cli_run import error_message
        _end_line(args)
        print(f"pagedserve: error: {error_message(err)}", file=sys.stderr)
        return EXIT_USAGE


def _end_line(args: argparse.Namespace) -> None:
    output = getattr(args, "output", None)
    if output is not None:
        output.end_line()


if __name__ == "__main__":
    sys.exit(main())
