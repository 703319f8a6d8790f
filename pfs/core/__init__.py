"""What clients and servers share: errors, the wire protocol and messages, authentication,
capabilities, layout math, configs, I/O engines, versions."""
