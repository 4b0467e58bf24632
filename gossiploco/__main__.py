from gossiploco.cli import app

app()
