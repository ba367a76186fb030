package main

import (
	"context"
	"errors"
)

func runControl(ctx context.Context, args []string) error { return errors.New("control: not built yet") }
