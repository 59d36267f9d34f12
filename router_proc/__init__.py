"""The PD router: one HTTP front for a prefill server and a decode server. Each request goes
to both at once with the same bootstrap room; the decode server's answer is the client's."""
