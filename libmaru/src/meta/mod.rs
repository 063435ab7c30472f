//! maru-server's sans-I/O core (in progress).
