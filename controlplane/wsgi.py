"""WSGI entry point (gunicorn, `controlplane.runtime.gunicorn`): the HTTP API and pages without
websockets, for the engines' lookup and registration traffic. A request runs straight on a worker
thread, without the ASGI server's hand-over to a thread for each synchronous view, which halves a
64-key lookup's time over HTTP. Websockets (the dashboard's live view) stay on daphne
(`controlplane.asgi`)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings.dev")
application = get_wsgi_application()
