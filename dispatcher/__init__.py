"""Direct assignment (issue 4, not built yet): JIQ idle queues, the amnesia list, comparison policies and the
discrete-event simulator. Until it lands, workers compete for messages on the broker ("pull" routing), and
requests for ``fleet.inbox.<worker>`` subjects have a stream (``FLEET_INBOX``) but no dispatcher."""
