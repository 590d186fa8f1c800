"""What the console scripts' flags share: a bad value is reported in two lines (the error,
then where the full list of flags is), and port values are checked when they are parsed."""

from __future__ import annotations

import argparse
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """:class:`argparse.ArgumentParser` whose errors skip the usage text: the master has
    over a hundred flags, and the one line that matters would come last."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n"
                     f"{self.prog}: run '{self.prog} --help' for all flags\n")


def port(text: str) -> int:
    """A TCP port flag: 0..65535, where 0 lets the kernel pick a free port."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(
            f"port {value} is not in 0..65535 (0 picks a free port)")
    return value


def host_port(text: str) -> str:
    """``host:port`` with a port in 1..65535 (an address to connect to); returned unchanged."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise argparse.ArgumentTypeError(f"expected host:port, got {text!r}")
    if not 1 <= int(port_text) <= 65535:
        raise argparse.ArgumentTypeError(f"port {int(port_text)} of {text!r} is not in 1..65535")
    return text


def os_reason(exc: BaseException) -> str:
    """The reason of an OSError alone (``socket.create_server`` appends "(while attempting
    to bind on address ...)", which the caller's message already names)."""
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return text.split(" (while attempting", 1)[0]


def install_hint(exc: ImportError) -> str:
    """How to install the module whose import failed (its extra, where it has one)."""
    name = (exc.name or "").split(".")[0]
    extra = {"etcd3gw": "etcd", "redis": "redis", "matplotlib": "sim",
             "aiohttp": "conductor", "zmq": "conductor"}.get(name)
    if extra:
        return f"pip install 'mooncake_plugins[{extra}]'"
    return f"pip install {name}" if name else "reinstall mooncake_plugins"
