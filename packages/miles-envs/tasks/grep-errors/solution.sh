#!/bin/sh
set -e
grep ERROR app.log > errors.log
