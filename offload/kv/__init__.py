"""The paged KV cache: fixed-size blocks on the device and host tiers (split by layer where a
plan runs some layers' attention on the host beside a device tier), sequences as block
tables over them (fork, truncate, swap), and how many blocks each tier and layer gets.

Imports only `options`."""
