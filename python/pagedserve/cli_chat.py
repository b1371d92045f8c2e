"""`pagedserve chat`: a conversation with the model in the terminal.

Replies stream to stdout after the "> " prompt; everything else (banner, notices, errors) goes to
stderr. Ctrl-C during a reply stops it (the request is aborted, the conversation kept, the partial
reply included) and returns to the prompt; at the prompt it only reminds how to leave. `exit`,
`quit`, `/exit`, `/quit` or Ctrl-D leave; `/reset` starts the conversation over.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional, TextIO

from pagedserve.cli_run import Output, engine_sampling_params, error_message, stream_reply

EXIT_WORDS = frozenset({"exit", "quit", "/exit", "/quit"})
RESET_WORD = "/reset"
BANNER = ("Chat with {name}. Ctrl-C stops a reply; /reset clears the conversation; "
          "exit, quit, /exit or Ctrl-D leaves.")


def run_chat(engine, args: argparse.Namespace, overrides: dict[str, Any], out: Optional[Output] = None,
             err: Optional[TextIO] = None) -> int:
    from pagedserve.engine.tokenizer import apply_chat_template

    from pagedserve.cli_args import read_chat_template

    info = engine.info()
    chat_template = read_chat_template(getattr(args, "chat_template", None))
    params = engine_sampling_params(engine, overrides)
    out = out or Output()
    err = err or sys.stderr
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = list(system)
    print(BANNER.format(name=info.model_name), file=err)
    turn = 0
    while True:
        try:
            line = input("> ")
        except EOFError:
            out.open_line = True  # input() left the cursor after "> "
            out.end_line()
            return 0
        except KeyboardInterrupt:
            out.open_line = True
            out.end_line()
            print("(Ctrl-C stops a reply; type exit or press Ctrl-D to leave)", file=err)
            continue
        except UnicodeDecodeError:
            print("error: the line is not valid UTF-8", file=err)
            continue
        command = line.strip()
        if command.lower() in EXIT_WORDS:
            return 0
        if command == RESET_WORD:
            history = list(system)
            print("conversation reset", file=err)
            continue
        if not command:
            continue
        history.append({"role": "user", "content": line})
        try:
            from pagedserve.engine.validation import check_text
            check_text(line)
            ids = apply_chat_template(info.tokenizer, history, add_generation_prompt=True,
                                      chat_template=chat_template)
            reply = stream_reply(engine, f"chat-{turn}", {"prompt_token_ids": ids}, params, out)
        except ValueError as error:  # e.g. the conversation outgrew max_model_len
            out.end_line()
            print(f"error: {error_message(error)}", file=err)
            history.pop()
            continue
        turn += 1
        history.append({"role": "assistant", "content": reply.texts[0]})
        if reply.interrupted:
            print("(stopped)", file=err)
