#!/bin/bash
# test-args: --wrap=hostname SCRIPT
hostname
