"""How a conversation becomes tokens and back, with no model: chat templates, turn ends, tool-call protocols.

  protocols.py      tool protocols (how a tool call is written and parsed), `Tool`, `Environment`
  chat_template.py  how a model's chat template renders a conversation
  stops.py          how a turn ends
"""
