"""What the launcher and the agents share on the wire: bootstrap, messages, handshake, records."""
