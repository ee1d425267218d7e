"""Using a finished run: generating and chatting with its model, and evaluating it."""
