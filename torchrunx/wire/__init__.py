"""What the launcher and the agents share on the wire: bootstrap, messages, handshake, records.

Before any connection exists, the launcher hands each agent an
:class:`~torchrunx.wire.bootstrap.AgentBootstrap` as one line of JSON on the agent's stdin
(where to connect, the secret, its settings); it is never pickled. Every connection is TCP from
an agent to the launcher's listening socket, or from a worker whose outcome is too large to go
through its agent (:class:`~torchrunx.wire.messages.DirectOutcome`); a worker's other messages
travel on its channel to its agent (a socket pair, :mod:`torchrunx.wire.channel`), which
forwards them on its own connection. It starts with a mutual
challenge-response handshake over a per-launch random secret (:mod:`torchrunx.wire.handshake`),
and nothing is unpickled from a peer before it has proved it knows that secret::

    launcher (server)                                agent / worker (client)
      accept  ── MAGIC | server nonce ──────────────▶
              ◀── MAGIC | role | client nonce | HMAC(secret, "client", role, ns, nc) ──
      verify  ── HMAC(secret, "server", nc, ns) ────▶ verify
              ◀════════════ sealed records (both ways) ════════════▶

After the handshake every byte travels in records sealed with AES-256-GCM
(:mod:`torchrunx.wire.records`). Each direction has its own key, derived with HKDF-SHA256 from
the secret and both nonces (so every connection's keys are new), and its own sequence number,
which is the record's nonce: a record that was altered, injected, replayed, reordered or
dropped fails authentication, and the connection is dropped before anything in it is
unpickled. A record is ``!I`` (length of what follows, also authenticated) and the ciphertext
of at most :data:`~torchrunx.wire.records.RECORD_BYTES` of plaintext with its 16-byte tag.

The plaintext is a stream of frames. A frame is ``!QI`` (header length, number of payload
parts), one ``!Q`` length per part, a pickled message dataclass of
:mod:`torchrunx.wire.messages`, then the raw parts (user data from
:mod:`torchrunx.serialization`: the pickle stream and one buffer per tensor). A large part
starts a new record, so a receiver decrypts it straight into its own buffer; small frames sent
together may share a record (:func:`~torchrunx.wire.records.take_plaintext`).

Modules, by what they own:

- :mod:`~torchrunx.wire.bootstrap`: the agent's bootstrap line and its checks.
- :mod:`~torchrunx.wire.messages`: the message dataclasses and the restricted unpickler that
  admits only them.
- :mod:`~torchrunx.wire.handshake`: the secret, the handshake, the session keys, and
  :func:`~torchrunx.wire.handshake.connect` (an agent's or worker's connection).
- :mod:`~torchrunx.wire.records`: sealed records, frames, and the framed
  :class:`~torchrunx.wire.records.Connection`.
- :mod:`~torchrunx.wire.channel`: a worker's channel to its agent: the same frames, plain, on
  a socket pair.
"""
