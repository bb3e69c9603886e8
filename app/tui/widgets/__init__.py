"""The chat screen's pieces: message list, prompt input, conversation sidebar, status bar."""
