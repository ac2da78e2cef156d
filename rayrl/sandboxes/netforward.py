"""In-sandbox forwarder: 127.0.0.1:<port> inside the sandbox -> the host proxy's unix socket.

Runs *inside* the sandbox at the start of every exec (its source is passed to the sandbox's python3 with
``-c``, so it must use the standard library only): it binds the port first, forks, the child relays
connections and the parent ``exec``s the real command. Binding before the fork means the command can
connect at once. The forwarder enforces nothing (the host proxy does); it dies with the exec's PID
namespace, so it never outlives the command, a timeout or a close.

    python3 -S -c <this file> rayrl-netfwd <port> <unix socket> <command...>
"""

import os
import selectors
import signal
import socket
import sys

_LIMIT = 256 * 1024  # bytes buffered per direction before we stop reading that side


class _End:
    """One socket of a relayed pair; ``out`` holds bytes waiting to be written to it."""

    def __init__(self, sock):
        self.sock = sock
        self.out = bytearray()
        self.eof = False  # nothing more will be read from this socket
        self.shut = False  # we sent FIN on this socket
        self.peer = None
        self.events = 0


def _update(sel, end):
    want = 0
    if not end.eof and len(end.peer.out) < _LIMIT:
        want |= selectors.EVENT_READ
    if end.out:
        want |= selectors.EVENT_WRITE
    if want == end.events:
        return
    if end.events and want:
        sel.modify(end.sock, want, end)
    elif want:
        sel.register(end.sock, want, end)
    else:
        sel.unregister(end.sock)
    end.events = want


def _close_pair(sel, end):
    for e in (end, end.peer):
        if e.events:
            sel.unregister(e.sock)
            e.events = 0
        e.sock.close()


def _finish_writes(end):
    if not end.out and end.peer.eof and not end.shut:
        end.shut = True
        try:
            end.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _on_ready(sel, end, mask):
    try:
        if mask & selectors.EVENT_READ:
            data = end.sock.recv(65536)
            if data:
                end.peer.out += data
            else:
                end.eof = True
                _finish_writes(end.peer)
        if mask & selectors.EVENT_WRITE and end.out:
            sent = end.sock.send(end.out)
            del end.out[:sent]
            _finish_writes(end)
    except (BlockingIOError, InterruptedError):
        pass
    except OSError:
        _close_pair(sel, end)
        return
    if end.eof and end.peer.eof and not end.out and not end.peer.out:
        _close_pair(sel, end)
        return
    _update(sel, end)
    _update(sel, end.peer)


def _serve(listener, unix_path):
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, None)
    while True:
        for key, mask in sel.select():
            if key.data is not None:
                _on_ready(sel, key.data, mask)
                continue
            try:
                client, _ = listener.accept()
            except OSError:
                continue
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                upstream.connect(unix_path)
            except OSError:
                client.close()
                upstream.close()
                continue
            a, b = _End(client), _End(upstream)
            a.peer, b.peer = b, a
            for e in (a, b):
                e.sock.setblocking(False)
                _update(sel, e)


def main(argv):
    port, unix_path, cmd = int(argv[2]), argv[3], argv[4:]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    if os.fork() == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        try:
            _serve(listener, unix_path)
        finally:
            os._exit(0)
    listener.close()
    for name in ("SIGPIPE", "SIGXFSZ"):  # python ignores these; the command must get the defaults
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    try:
        os.execvp(cmd[0], cmd)
    except OSError as err:
        sys.stderr.write(f"{cmd[0]}: {err.strerror}\n")
        os._exit(126 if isinstance(err, PermissionError) else 127)


if __name__ == "__main__":
    main(sys.argv)
