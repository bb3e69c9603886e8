"""The paged KV cache: fixed-size blocks on the device and host tiers, sequences as block
tables over them (fork, truncate, swap), and how many blocks each tier gets.

Imports only `options`."""
