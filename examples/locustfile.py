"""Load-test a server with Locust through kvclient (honours Retry-After, shared cooldown).

pip install 'kvclient[locust]'
locust -f examples/locustfile.py --host http://127.0.0.1:8000 --headless -u 32 -r 8 -t 1m
# more load than one core gives: add --processes 4 (or run --master and several --worker)
"""

from locust import between

from kvclient.locust import KVClientUser


class ChatUser(KVClientUser):
    chat = True
    stream = True
    wait_time = between(0.05, 0.2)


class CompletionUser(KVClientUser):
    chat = False
    wait_time = between(0.05, 0.2)
