"""`ember chat`: the Textual terminal chat app.

`app.py` holds the App and the chat flow, `conversations.py` its conversation management;
`store.py` persists conversations in SQLite; `engine_port.py` is the narrow interface the App
uses to talk to an engine (the real one, or the tests' fake); `widgets/` and
`screens/` are the pieces on screen.
Nothing here is imported by the rest of Ember.
"""
