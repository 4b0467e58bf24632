"""``gossiploco dashboard``: watch a run live in a browser (observer.py: the DHT observer; app.py: the web app;
static/: the page, shipped inside the package)."""
