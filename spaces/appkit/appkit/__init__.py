"""What the project's apps share and the deltasync library does not need: each Space's request-body limit and
server start (`asgi`), its settings from the environment (`settings`), byte counts for people (`units`).

Each Space bundle carries this package beside its app.py (`python -m trainer.deploy`); in this repository
`make setup` installs it (`pip install -e spaces/appkit`) for the Spaces run locally and for the trainer.
"""
